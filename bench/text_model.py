"The text workflow's model, at a module's top level: TorchDynamo can save the code of a class defined here (`precompile=True`), not of one defined inside a function"
import torch
from torch import nn

class TextClassifier(nn.Module):
    "Token and position embeddings, a pre-norm transformer encoder, mean pooling, a linear head"
    def __init__(self, vocab, seq, d, layers, heads, n_out):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(1, seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4*d, dropout=0.1, activation='gelu', batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, n_out)
    def forward(self, x):
        h = self.encoder(self.tok(x) + self.pos[:, :x.shape[1]])
        return self.head(self.norm(h).mean(1))
