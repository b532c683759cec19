"""The policy base every causal-LM policy builds on, and sampling."""
