"""Accuracy against ground truth: OmniDocBench annotations and the edit-distance scores of a page."""
