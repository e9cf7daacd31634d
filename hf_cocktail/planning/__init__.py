"""Planning: each sequence's chunk plan, chunk scores (encoder, BM25, attention), the chunk search, salient tokens."""
