"""Text and tokens, no model: FIM/EFIM prompt templates (`templates`), segment tokenization
and token healing (`tokenize`), and sampling with healing and the fresh-line rule (`sampler`)."""
