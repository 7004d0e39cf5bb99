"""The report: the writer, its schema, the renderers, comparison and export."""
