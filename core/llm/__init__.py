"""LLM providers behind one streaming protocol."""
