import pytest

from lade_export.errors import ProfileError
from lade_export.profile import LookaheadProfile, load_profile, resolve_profile


def test_max_step_is_one_plus_window_and_guesses_times_levels():
    p = LookaheadProfile(7, 5, 7)
    assert p.levels == 4
    assert p.max_step == 1 + (7 + 7) * 4 == 57
    assert p.max_logit_rows == 1 + 7 + 7 * 4


@pytest.mark.parametrize(
    "w,n,g,message",
    [
        (-1, 3, 2, "window (W) must be ≥ 0, got -1"),
        (2, 1, 2, "ngram (N) must be ≥ 2, got 1"),
        (2, 3, -1, "guesses (G) must be ≥ 0, got -1"),
        (2.5, 3, 2, "window must be an integer, got 2.5"),
        (2, True, 2, "ngram must be an integer, got True"),
    ],
)
def test_invalid_values_are_rejected_on_construction(w, n, g, message):
    with pytest.raises(ProfileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LookaheadProfile(w, n, g)


def test_bundled_profiles_load_and_round_trip(tmp_path):
    for name, expected in {"default": (1, 3, 2), "wide": (5, 4, 5), "small": (2, 3, 2), "paper": (7, 5, 7),
                           "gpu-large": (15, 5, 15)}.items():
        p = resolve_profile(name)
        assert (p.window, p.ngram, p.guesses) == expected
        assert p.name == name
        f = tmp_path / f"{name}.toml"
        f.write_text(p.to_toml(comments="measured: nothing\nsecond line"))
        assert load_profile(f) == p


def test_inline_triple():
    p = resolve_profile("3,4,2")
    assert (p.window, p.ngram, p.guesses, p.max_step) == (3, 4, 2, 16)


def test_toml_errors_name_the_file_and_line(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[lookahead]\nwindow = 3\nngram = = 4\n")
    with pytest.raises(ProfileError, match=r"bad.toml: TOML syntax error: .*line 3"):
        load_profile(f)


def test_unknown_keys_are_named(tmp_path):
    f = tmp_path / "typo.toml"
    f.write_text("[lookahead]\nwindow = 3\nngram = 4\nguesses = 2\nguess = 5\n")
    with pytest.raises(ProfileError, match=r"unknown key\(s\) in \[lookahead\]: guess"):
        load_profile(f)


def test_missing_file():
    with pytest.raises(ProfileError, match="profile file not found: /nonexistent/p.toml"):
        load_profile("/nonexistent/p.toml")


def test_a_disabled_profile_needs_no_shape(tmp_path):
    f = tmp_path / "off.toml"
    f.write_text("[lookahead]\nenabled = false\n")
    profile = load_profile(f)
    assert not profile.enabled and profile.max_step == 1
    with pytest.raises(ProfileError, match="missing key 'window'"):
        f.write_text("[lookahead]\nngram = 3\nguesses = 2\n")
        load_profile(f)


def test_empty_and_directory_profiles_are_named(tmp_path):
    with pytest.raises(ProfileError, match=r"^empty profile: give a TOML path, a shipped name \(.*default.*\), "
                                           r"W,N,G\[,K\[,B\]\], or 'greedy' for plain greedy decoding$"):
        resolve_profile("  ")
    with pytest.raises(ProfileError, match=r"^profile path is a directory, not a TOML file: "):
        resolve_profile(str(tmp_path))
