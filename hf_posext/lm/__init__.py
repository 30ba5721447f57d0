"""Torch-only language-model scoring shared by training, evaluation and search (layer 5).

:mod:`hf_posext.lm.chunked_loss`: a causal-LM cross-entropy that never materialises the full logits.
:mod:`hf_posext.lm.scoring`: the summed next-token NLL of evaluation and search, in chunks of hidden states.
:mod:`hf_posext.lm.distributed`: rank, world size, sharding and gathering for evaluation and search.
"""
