"""Flax NNX modules built on the jax_ep ops."""
from jax_ep.nn.engram import Engram
from jax_ep.nn.moe import MoE

__all__ = ["Engram", "MoE"]
