"""Mixture of Experts (Megatron-Core's moe/): router.py, experts.py, layer.py."""
