"""Model building blocks: tensor-parallel linears and embeddings, norms, rotary, attention."""
