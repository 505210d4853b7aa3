"""Checkpoints: the lazy per-rank safetensors reader that checks every tensor (``reader``), the weights
it yields (``weights``), the ModelOpt NVFP4 codec (``nvfp4``), the NaN/Inf scan (``finite``), and the
synthetic checkpoints in the real format (``synth``).
"""
