from megalite.models.gpt import GPTModel

__all__ = ["GPTModel"]
