"""SGLang glue: the only package of sglang_tiered that imports `sglang`. See plugin.py for the list of seams."""
