"""Exporters: tables, JSON and CSV (report), Graphviz, ONNX. They read annotations only."""
