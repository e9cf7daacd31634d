"""Configuration and presets: the validated `CocktailConfig`, its rules for settings that another makes moot, Hub
files and generated model cards."""
