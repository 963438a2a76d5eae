"""The offline search (paper Sec. 4.3, Algorithm 1): semantic retrieval heads, ARR metrics, the configuration
search that writes a target-draft pair's DustinConfig, and its CLI (`trtllm-dustin srh|arr|search`).

  srh.py              needle-in-a-haystack retrieval scores per head (SRH identification)
  attention_probe.py  per-head attention of captured queries; attention_trace.py: traces over validation windows
  arr.py, arr_kl.py   attention recall ratio of a policy's set, and its agreement with the output KL
  algorithm.py        Algorithm 1: layers, heads, budget split m -> DustinConfig
  needle_haystack.py, rouge.py, plots.py, cli.py
"""
