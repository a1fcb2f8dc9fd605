"""The benchmark and demo tools, kept apart from the library (nothing in torch_fce's
ops, lowering, integrations or distributed imports them).

    python -m torch_fce.bench SUBCOMMAND ...     (--help lists them: SUBCOMMANDS in
                                                 __main__.py, one module each)

measure.py times and measures peak memory; tiny_lm.py is the small causal LM the main
job (python -m torch_fce) and the lowering benchmark train.
"""
