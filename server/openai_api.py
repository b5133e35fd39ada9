"""OpenAI-compatible routes (being written)."""

from fastapi import APIRouter

router = APIRouter()
