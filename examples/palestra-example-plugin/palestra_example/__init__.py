"""An example third-party Palestra plugin.

Palestra imports this module because pyproject.toml names it in the ``palestra`` entry-point group, then calls
the hooks below (their names must match ``palestra.hookspecs`` exactly; a misspelt one is an error). Each
``register`` call makes one component available to configs under the given name.
"""

from palestra import hookimpl

from .environment import WordUsageEnvironment, WordUsageOptions
from .reward import KeywordCoverage, KeywordOptions

__version__ = "0.1.0"
# The plugin API versions this plugin is written for: palestra disables it, with one warning, if it provides another.
PALESTRA_PLUGIN_API = ">=2.0,<3"


@hookimpl
def register_rewards(register):
    register(
        "keyword_coverage",
        KeywordCoverage,
        options=KeywordOptions,
        description="fraction of the required keywords that appear in the completion",
    )


@hookimpl
def register_environments(register):
    register(
        "word_usage",
        WordUsageEnvironment,
        options=WordUsageOptions,
        description="write one sentence that uses the given words (single agent, single turn)",
    )
