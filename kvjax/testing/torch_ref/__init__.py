"""Torch implementations of the kvjax ops (what a torch runner would write), for differential tests."""
