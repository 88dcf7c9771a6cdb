from megalite.models.bert import BertModel
from megalite.models.gpt import GPTModel

__all__ = ["BertModel", "GPTModel"]
