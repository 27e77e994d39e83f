"""attnx inside other libraries: ``attnx.integrations.transformers`` (Hugging Face)."""
