"""DeepSeek-OCR v1: modules, preprocessing, postprocessing and checkpoint loading."""
