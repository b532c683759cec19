"""Agents: code written for an OpenAI-compatible client, trained through a rollout endpoint (docs/environments.md)."""

from __future__ import annotations

from palestra.agents.api import Agent, AgentResult, AgentTask

__all__ = ["Agent", "AgentResult", "AgentTask"]
