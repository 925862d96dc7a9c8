"""The objectives, as pure functions of arrays: noise schedules, forward
masking, SUBS and the MDLM NELBO (`mdlm`), block diffusion (BD3-LM, `bd3`),
the AR loss, and the jit-static objective objects the trainer calls."""

from mdlm_jax.diffusion import bd3
from mdlm_jax.diffusion.mdlm import (LN2, NEG_INF, Schedule, ar_nll, forward_mask, masked_token_nll, nelbo_per_token,
                                     sample_times, subs_log_probs, summarize)
from mdlm_jax.diffusion.objectives import ARObjective, BD3Objective, MDLMObjective, from_config

__all__ = ["bd3", "LN2", "NEG_INF", "Schedule", "ar_nll", "forward_mask", "masked_token_nll", "nelbo_per_token",
           "sample_times", "subs_log_probs", "summarize", "ARObjective", "BD3Objective", "MDLMObjective",
           "from_config"]
