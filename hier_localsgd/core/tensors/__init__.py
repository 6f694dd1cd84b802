"""Model-state numerics: the flat parameter view (and FSDP2 shards), a level's backup and
outer optimizer, streaming fragments, blockwise compression and the compressed all-reduce,
the consistency guard and poison screen.

May import core.runtime; never core.links or core.ft.
"""
