"""Measuring a built artifact: interleaved comparisons against plain greedy, other
builds and peer engines (``lade-export compare``), profile tuning (``lade-export tune``)
and the paper's workloads. Decodes from artifacts only: no export-time library is
imported (the transformers peer imports torch when it is asked for).

============  =====================================================================
module        job
============  =====================================================================
``compare``   interleaved runs, exactness check, the report (JSONL, Markdown, plot)
``peers``     transformers and llama.cpp as peers, run at their best settings
``tune``      pick a lookahead profile from measured step costs and acceptance
``datasets``  MT-Bench, HumanEval, GSM8K and chat prompt sets (JSONL)
============  =====================================================================
"""
