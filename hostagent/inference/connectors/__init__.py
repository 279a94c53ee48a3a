"""The pool as each serving engine sees it: one module per engine (``vllm``, ``hf`` for Hugging
Face transformers, ``lmcache``, ``sglang``) over one pool I/O (``pool_io``: one loop thread, one
client and placement, one settings check in ``options``) and the block keys every engine shares
(``block_keys``). Heavy engines are imported only by their own module."""
