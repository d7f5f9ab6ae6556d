"""Storage: Parquet stores under DuckDB views, MEDS datasets, vocabularies, cohorts, importers."""
