import torch
from meshplan.models.hf import hf_llama
CFG = dict(num_hidden_layers=8, hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False, attention_dropout=0.0)
def model():
    return hf_llama(CFG).train()
if __name__ == "__main__":
    torch.manual_seed(7)
    hf_llama(CFG).save_pretrained("hf_weights")
