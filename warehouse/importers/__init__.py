"""Importers: official source layouts in, a complete MEDS directory out.

Each importer writes into a staging directory and swaps it into place only when the whole
directory is written and validated, so nothing half-written is ever visible or registered.
"""

from warehouse.importers.mimic import ImportSummary, import_mimic3, import_mimic4

__all__ = ["ImportSummary", "import_mimic3", "import_mimic4"]
