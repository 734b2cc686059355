"""Instruments that watch ranks: every collective a process group runs (``tracing``), the bytes
a rank really sent (``wire``) and the bytes its tensors hold (``memory``). May import
``course.runtime``."""
