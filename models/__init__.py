"""Foundation models and baselines: the structured-EHR prior, frequency/history baselines, LLM backends."""
