"""Training and measuring it: the train loop (`trainer`), likelihood
evaluation, the metrics log and loss curve, FLOPs and MFU, and memory plans
for meshes one does not have (`memory_plan`)."""

from mdlm_jax.training.evaluation import Scorer, evaluate
from mdlm_jax.training.trainer import train

__all__ = ["Scorer", "evaluate", "train"]
