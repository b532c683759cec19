"""The example plugin's components against palestra's contract (``palestra.testing``).

``palestra_contract`` is a fixture of palestra's pytest plugin, which pytest loads wherever palestra is installed:
no conftest, no imports. Each call runs ``palestra.testing.check_<kind>`` and fails the test with one line
naming the component, the method and the broken rule. Run it from this folder, with the plugin installed:
``pip install -e .. && python -m pytest``.
"""


def test_word_usage_keeps_the_environment_contract(palestra_contract):
    # reward=...: the episodes' metadata (the words to use) must be what keyword_coverage reads
    palestra_contract("environment", "word_usage", {"num_words": 3}, reward="keyword_coverage")


def test_keyword_coverage_keeps_the_reward_contract(palestra_contract):
    # environment=...: the rows it scores come from word_usage, whose metadata holds each task's keywords
    palestra_contract("reward", "keyword_coverage", environment="word_usage")


def test_keyword_coverage_with_fixed_keywords_keeps_the_reward_contract(palestra_contract):
    palestra_contract("reward", "keyword_coverage", {"keywords": ["apple", "river"], "whole_words": False})
