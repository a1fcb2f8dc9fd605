"""The benchmark and demo tools, kept apart from the library (nothing in torch_fce's
ops, lowering, integrations or distributed imports them).

    python -m torch_fce.bench shapes ...         methods x shapes: time, memory, errors
    python -m torch_fce.bench lowering ...       a compiled TinyLM step with and without the pass
    python -m torch_fce.bench transformers ...   a transformers llama step, patched and not
    python -m torch_fce.bench distributed ...    the vocab-parallel loss on 2+ GPUs

measure.py times and measures peak memory; tiny_lm.py is the small causal LM the main
job (python -m torch_fce) and the lowering benchmark train.
"""
