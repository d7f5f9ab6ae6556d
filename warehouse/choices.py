"""The values that cohort, forecast and output options take, kept apart from the modules that use them so that the
CLI's option choices and the settings' patterns come from the same lists as the stages' checks without importing
those stages (and their libraries) at start."""

TARGET_RULES = ("final", "every")  # a cohort's target encounters: each patient's final one, or every one
HARMONIZATIONS = ("native", "icd10", "category", "icd10_closest")  # ICD renderings of a cohort's codes
FORECAST_SPLITS = ("train", "tuning", "held_out", "all")  # the MEDS splits, and all of them at once
OUTPUT_FORMATS = ("table", "csv", "json")  # a query's result (`warehouse.sql.stream_query`): aligned, CSV, JSON lines


def pattern(choices: tuple[str, ...]) -> str:
    """A regular expression that accepts exactly one of `choices` (for a settings field)."""
    return f"^({'|'.join(choices)})$"
