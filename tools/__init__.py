"""Research tools the agents call: local corpora (BM25 + dense), web search and reader, ICD dictionary, ledger."""
