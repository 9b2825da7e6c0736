"""Profile.link looks links up in an index (launcher/planning/profile_file.py): the answers of a scan
of every link, the first of two that name the same pair, and never an index of links it no longer has."""

from __future__ import annotations

import itertools
import random

import pytest

from hetlaunch.launcher.planning.profile_file import LinkProfile, ProfileError
from plan_reference import random_profile

pytestmark = pytest.mark.quick


def _scanned(profile, a, b):
    """What link() answered before the index: the first node link of the pair, else the first region link."""
    for link in profile.links:
        if link.nodes is not None and set(link.nodes) == {a.name, b.name}:
            return link
    for link in profile.links:
        if link.regions is not None and sorted(link.regions) == sorted((a.region, b.region)):
            return link
    return None


def test_the_index_answers_as_a_scan_of_every_link():
    rng = random.Random(11)
    for _ in range(60):
        profile = random_profile(rng, rng.randint(2, 7), rng.randint(1, 4), 4)
        extra = []
        for a, b in rng.sample(list(itertools.combinations(profile.nodes, 2)), k=min(3, len(profile.nodes) - 1)):
            extra.append(LinkProfile(nodes=(a.name, b.name), bandwidth_bytes_per_s=rng.uniform(1e6, 1e9), latency_s=0.01))
            extra.append(LinkProfile(nodes=(b.name, a.name), bandwidth_bytes_per_s=1.0, latency_s=9.0))  # the second: ignored
        regions = sorted({n.region for n in profile.nodes})
        extra.append(LinkProfile(regions=(regions[-1], regions[0]), bandwidth_bytes_per_s=2.0, latency_s=8.0))  # a repeat
        profile = profile.model_copy(update={"links": extra + list(profile.links)})
        for a, b in itertools.product(profile.nodes, repeat=2):
            assert profile.link(a, b) is _scanned(profile, a, b)


def test_a_copy_with_other_links_is_not_answered_from_the_old_index():
    profile = random_profile(random.Random(2), 4, 2, 4)
    a = profile.nodes[0]
    b = next(n for n in profile.nodes if n.region != a.region)
    assert profile.link(a, b).regions is not None  # the index is made
    fewer = profile.model_copy(update={"links": [link for link in profile.links if link.regions[0] == link.regions[1]]})
    with pytest.raises(ProfileError, match="has no link between"):
        fewer.link(a, b)
    assert profile.link(a, b) is _scanned(profile, a, b)
    profile.links.append(LinkProfile(nodes=(a.name, b.name), bandwidth_bytes_per_s=3.0, latency_s=1.0))
    assert profile.link(a, b).nodes == (a.name, b.name)  # a list grown in place is indexed again
    profile.links[0] = LinkProfile(regions=profile.links[0].regions, bandwidth_bytes_per_s=7.0, latency_s=1.0)
    for x, y in itertools.product(profile.nodes, repeat=2):  # a link replaced in place is seen too
        assert profile.link(x, y) is _scanned(profile, x, y)


def test_a_profile_that_looked_up_a_link_still_equals_its_copy():
    """pydantic's == compares a model's private state: an index kept in it made a profile unequal to
    its own copy once link() had run (a review)."""
    profile = random_profile(random.Random(4), 3, 2, 4)
    copy = profile.model_copy(deep=True)
    profile.link(profile.nodes[0], profile.nodes[1])
    assert profile == copy





def test_a_lookup_does_not_cost_a_scan_of_every_link(monkeypatch):
    """Comparing every link's id on every call made a lookup cost as much as a scan: 200 one-node
    regions (20,100 links) planned for over a minute (a hostile review). Counted, not timed: the
    links are walked to make the index, then not again until they change."""
    from hetlaunch.launcher.planning import profile_file

    walks = []
    walk = profile_file._Links.__iter__
    monkeypatch.setattr(profile_file._Links, "__iter__", lambda links: walks.append(1) or walk(links))
    profile = random_profile(random.Random(5), 6, 6, 4)
    a, b = profile.nodes[0], profile.nodes[-1]
    found = profile.link(a, b)  # the index made: one walk
    assert found is _scanned(profile, a, b) and len(walks) == 1 + 2  # and _scanned's own two
    walks.clear()
    for _ in range(100):
        assert profile.link(a, b) is found
    assert walks == []
    profile.links.append(LinkProfile(nodes=(a.name, b.name), bandwidth_bytes_per_s=3.0, latency_s=1.0))
    assert profile.link(a, b).nodes == (a.name, b.name) and len(walks) == 1  # made again, once
