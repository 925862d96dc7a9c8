"""python -m mdlm_jax.bench {train,sample,serve,kernels,humaneval,agent,layouts,tools,longctx,passkey,ar,a2d,ablate} [--json] [options]"""

import sys

COMMANDS = {"train": "mdlm_jax.bench.train", "sample": "mdlm_jax.bench.sample", "serve": "mdlm_jax.bench.serve",
            "kernels": "mdlm_jax.bench.kernels", "humaneval": "mdlm_jax.bench.humaneval",
            "agent": "mdlm_jax.bench.agent", "layouts": "mdlm_jax.bench.layouts",
            "tools": "mdlm_jax.bench.tools",
            "longctx": "mdlm_jax.bench.longctx",
            "passkey": "mdlm_jax.bench.passkey", "ar": "mdlm_jax.bench.ardecode", "a2d": "mdlm_jax.bench.a2d",
            "ablate": "mdlm_jax.bench.ablate"}


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] not in COMMANDS:
    print(f"usage: python -m mdlm_jax.bench {{{','.join(COMMANDS)}}} [--json] [options]", file=sys.stderr)
    sys.exit(2)
  import importlib
  importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
  main()
