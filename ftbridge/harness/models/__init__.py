"""Models trained by ftbridge's examples and tests."""

from ftbridge.harness.models.char_gpt import CharGPT, GPTConfig, build_model, param_count

__all__ = ["CharGPT", "GPTConfig", "build_model", "param_count"]
