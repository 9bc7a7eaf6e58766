"""Draft backends: all implement :class:`edge_sdk.drafters.base.Drafter`."""

from edge_sdk.drafters.base import DraftBlock, Drafter

__all__ = ["DraftBlock", "Drafter"]
