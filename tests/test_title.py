from core.title import clean_title


def test_quotes_prefix_and_final_punctuation_are_removed():
    assert clean_title('  "Title: Capital of France."\nextra line') == "Capital of France"


def test_a_rambling_answer_is_cut_to_a_handful_of_words():
    title = clean_title("I'm glad I could help you with that question about the capital of France today")
    assert title == "I'm glad I could help you with that…"
    assert len(clean_title("x" * 200)) <= 61
