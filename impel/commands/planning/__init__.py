"""Planning tools: the training-memory estimator (``impel estimate-memory``) and the automatic strategy choice."""
