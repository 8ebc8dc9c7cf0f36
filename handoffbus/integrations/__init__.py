"""Bridges to agent frameworks: ``openai_agents`` (the OpenAI Agents SDK). The A2A views are
in ``handoffbus.a2a``."""
