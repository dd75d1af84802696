"""Measuring a built artifact: interleaved comparisons against plain greedy, other
builds and peer engines (``lade-export compare``), profile tuning (``lade-export tune``)
and the paper's workloads. Decodes from artifacts only: no export-time library is
imported (the transformers peer imports torch when it is asked for).

=====================  =====================================================================
module                 job
=====================  =====================================================================
``compare``            interleaved runs of every configuration on each prompt, exactness check
``report``             the figures per dataset × configuration and the files (JSONL, CSV, Markdown, plot)
``peers``              peer names; :class:`~.peers.Peers` runs the peers asked for, prompt by prompt
``transformers_peer``  transformers' ``generate`` (greedy, prompt lookup) on float32 weights
``llama_cpp``          llama.cpp's greedy CLI and lookahead example, and their output parsers
``peer_output``        what one peer generation returns (shared by the two peer modules)
``tune``               pick a lookahead profile from measured step costs and acceptance
``datasets``           MT-Bench, HumanEval, GSM8K and chat prompt sets (JSONL)
=====================  =====================================================================
"""
