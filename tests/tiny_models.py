"""The tiny random Hugging Face MoE config the runtime tests share (no pytest here; transformers is
imported on call, so a test module skips on its own ``importorskip`` before calling)."""

from __future__ import annotations


def tiny_mixtral(layers: int, experts: int = 8):
    """A Mixtral of ``layers`` layers and ``experts`` experts (top-2, hidden 32, 4 attention heads over
    2 KV heads, vocabulary 64): seconds per run on gloo ranks."""
    import transformers as tf

    return tf.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        intermediate_size=48,
        num_local_experts=experts,
        num_experts_per_tok=2,
        initializer_range=0.2,
    )
