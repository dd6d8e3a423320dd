"""What a bad subject's error says: the subject once and, in a subject of several tokens, the
offending token and its position -- before, the subject was named twice ("token 0 of subject
'a b' 'a b' is not a subject token")."""

from __future__ import annotations

import pytest

from shared.subjects import SubjectError, Subjects, validate_subject, validate_token


@pytest.mark.parametrize(("subject", "message"), [
    ("a b", "subject 'a b' is not a legal subject: lowercase letters"),
    ("Vtm", "subject 'Vtm' is not a legal subject: lowercase letters"),
    ("vtm.A.x", "token 1 ('A') of subject 'vtm.A.x' is not a subject token: lowercase"),
    ("vtm..x", "token 1 ('') of subject 'vtm..x' is not a subject token"),
    ("vtm.a b", "token 1 ('a b') of subject 'vtm.a b' is not a subject token"),
])
def test_the_message_names_each_value_once(subject: str, message: str) -> None:
    with pytest.raises(SubjectError) as err:
        validate_subject(subject)
    text = str(err.value)
    assert text.startswith(message), text
    assert text.count(repr(subject)) == 1, text


def test_wildcards_and_tokens_are_unchanged() -> None:
    assert validate_subject("vtm.*.x.>", allow_wildcards=True) == "vtm.*.x.>"
    with pytest.raises(SubjectError, match=r"token 1 \('\*'\) of subject 'vtm\.\*'"):
        validate_subject("vtm.*")
    with pytest.raises(SubjectError, match="^worker id 'W 1' is not a subject token: "):
        validate_token("W 1", what="worker id")


def test_a_bad_prefix_is_named_once() -> None:
    """The message a user meets first: ``--prefix`` / ``VTM_SUBJECT_PREFIX``."""
    with pytest.raises(SubjectError) as err:
        Subjects("Bad Prefix")
    assert str(err.value).count("'Bad Prefix'") == 1, err.value
