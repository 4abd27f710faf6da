"""
The project's example end to end, under crashes (issue 30): database users registers users, each
registration's transaction emits user.registered (one in ten is rolled back); our relay publishes
them; database mail subscribes with a handler that queues one welcome mail per event.  While
sessions register, servers are killed:
- one cluster (port +32, outbox.databases = 'users, mail'): the whole server killed with SIGKILL
  ten times, the inbox worker alone with SIGKILL twice (PostgreSQL handles it as a crash of the
  server) and with SIGTERM once (the launcher starts it again);
- two clusters (users on +32, mail on +33): each server killed with SIGKILL three times.
The relay sends a batch again after each crash of the users side, at new offsets.

Every committed registration yields exactly one mail row; one whose COMMIT raised (unknown outcome)
yields one if and only if its user row exists; a rolled-back one yields none.
"""
import dataclasses
import os
import random
import signal
import time

from conftest import create_topics, new_aggregate_type, pg_connect, query, query_one, report, wait_until
from helpers_crash import kill9, pid_alive, postmaster_pid, start_pg_after_crash
from helpers_inbox import (RegistrationLoad, existing_users, mail_counts, registration_schema,
                           subscribe, wait_caught_up)
from helpers_lifecycle import connect_db, extra_cluster, set_system

SESSIONS = 4
DRAIN_TIMEOUT_S = 240


def fresh_inbox_pid(mail_env, old=None):
    c = connect_db(mail_env, "mail")
    try:
        rows = query(c, "SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox inbox'"
                        " AND datname = 'mail'")
        pid = rows[0][0] if rows else None
        return pid if pid is not None and pid != old else None
    finally:
        c.close()


def crash(kind, users_env, mail_env, load, n):
    """One crash: server (of users_env's cluster), mail_server, inbox (SIGKILL of the inbox worker)
    or term (SIGTERM of it).  Returns when a new inbox worker of mail runs."""
    old = wait_until(lambda: fresh_inbox_pid(mail_env), 60, f"the inbox worker (crash {n})")
    if kind == "term":
        os.kill(old, signal.SIGTERM)
    elif kind in ("server", "mail_server"):
        victim = users_env if kind == "server" else mail_env
        touches_load = victim.pg_port == users_env.pg_port
        if touches_load:
            load.close_gate()
        pm = postmaster_pid(victim)
        kill9(pm)
        # until it is gone, pg_ctl status (and pg.sh start) take it for running
        wait_until(lambda: not pid_alive(pm), 60, "the killed postmaster to be gone", interval=0.02)
        if touches_load:
            wait_until(load.all_parked, 60, f"every session to lose its connection ({n})", interval=0.02)
        if victim.pg_port == mail_env.pg_port:
            wait_until(lambda: not pid_alive(old), 60, "the orphaned inbox worker to exit", interval=0.02)
        start_pg_after_crash(victim)
        load.open_gate()
    else:
        load.close_gate()
        kill9(old)
        if users_env.pg_port == mail_env.pg_port:
            wait_until(load.all_parked, 60, f"every session to lose its connection ({n})", interval=0.02)
        load.open_gate()
    if kind != "server" or users_env.pg_port == mail_env.pg_port:
        wait_until(lambda: fresh_inbox_pid(mail_env, old), 90, f"a new inbox worker after {kind} ({n})")


def registrations_to_mail(env, users_env, mail_env, plan, seed, what):
    rng = random.Random(seed)
    users = connect_db(users_env, "users")
    mail = connect_db(mail_env, "mail")
    query(users, "CREATE EXTENSION outbox")
    query(mail, "CREATE EXTENSION outbox")
    registration_schema(users, mail)
    agg = new_aggregate_type("user")
    topic = query_one(users, "SHOW outbox.topic_prefix")[0] + agg
    create_topics(env, [topic])
    subscribe(mail, "welcome_mail", [topic], "send_welcome_mail")
    users.close()
    mail.close()

    load = RegistrationLoad(dataclasses.replace(users_env, pg_database="users"), aggregate_type=agg,
                            sessions=SESSIONS, rollback_share=0.1, seed=seed)
    recoveries = []
    try:
        load.start()
        load.wait_progress(20, 60, "every session to register (first)")
        wait_until(lambda: fresh_inbox_pid(mail_env), 60, "the inbox worker of mail")
        t0 = time.monotonic()
        for n, kind in enumerate(plan):
            load.wait_progress(10, 90, f"every session to register, before crash {n},")
            time.sleep(rng.uniform(0.2, 2.0))
            t_kill = time.monotonic()
            crash(kind, users_env, mail_env, load, n)
            recoveries.append(f"{kind[0]}{time.monotonic() - t_kill:.1f}s")
        load.wait_progress(10, 90, "every session to register, after the last crash,")
        load_s = time.monotonic() - t0
    finally:
        load.open_gate()
        load.stop()

    users = connect_db(users_env, "users")
    mail = connect_db(mail_env, "mail")
    unknown_exist = existing_users(users, load.unknown)
    expected = load.committed | unknown_exist
    must_not = load.rolled_back | (load.unknown - unknown_exist)
    assert not load.errors, load.errors[:5]
    assert not existing_users(users, load.rolled_back), "a rolled-back registration exists"
    t_end = time.monotonic()
    def all_mailed():
        counts = mail_counts(mail)
        return all(u in counts for u in expected)
    wait_until(all_mailed, DRAIN_TIMEOUT_S, "a mail for every committed registration", interval=1)
    drain_s = time.monotonic() - t_end
    wait_caught_up(mail, "welcome_mail")
    counts = mail_counts(mail)
    lost = [u for u in expected if u not in counts]
    twice = {u: n for u, n in counts.items() if n > 1}
    wrong = [u for u in counts if u in must_not]
    unexpected = [u for u in counts if u not in expected and u not in must_not]
    st = query(mail, "SELECT sum(applied), sum(duplicates), sum(dead_letters) FROM outbox.inbox_status"
                     " WHERE subscription = 'welcome_mail'")[0]
    report(f"INBOX CRASH ({what}): {len(plan)} crashes (order {''.join(k[0] for k in plan)}, seed {seed}; "
           f"s = users server SIGKILL, m = mail server SIGKILL, i = inbox worker SIGKILL, t = inbox worker "
           f"SIGTERM), {SESSIONS} sessions for {load_s:.0f}s: {len(load.committed)} registrations "
           f"committed, {len(load.unknown)} unknown ({len(unknown_exist)} exist), {len(load.rolled_back)} "
           f"rolled back; mails: {sum(counts.values())} for {len(counts)} users, {len(lost)} lost, "
           f"{len(twice)} applied twice, {len(wrong)} from rolled-back or missing registrations; inbox "
           f"applied {st[0]}, dropped {st[1]} duplicates (relay re-sends), {st[2]} dead letters; "
           f"recovery {', '.join(recoveries)}; drained {drain_s:.1f}s after the load stopped")
    assert not lost, f"{len(lost)} registrations without a mail, e.g. {lost[:3]}"
    assert not twice, f"{len(twice)} users mailed twice, e.g. {list(twice.items())[:3]}"
    assert not wrong, f"mails for rolled-back registrations: {wrong[:3]}"
    assert not unexpected, unexpected[:3]
    assert st[2] == 0
    users.close()
    mail.close()


def test_registration_to_mail_exactly_once_under_crashes(env):
    seed = int(time.time()) % 100000
    plan = ["server"] * 10 + ["inbox"] * 2 + ["term"]
    random.Random(seed).shuffle(plan)
    with extra_cluster(env, "inbox-crash", 32, database="postgres") as other:
        admin = pg_connect(other)
        query(admin, "CREATE DATABASE users")
        query(admin, "CREATE DATABASE mail")
        set_system(admin, "outbox.databases", "users, mail")
        admin.close()
        registrations_to_mail(env, other, other, plan, seed, "one cluster")


def test_registration_to_mail_across_two_clusters(env):
    seed = int(time.time()) % 100000 + 1
    plan = ["server", "mail_server"] * 3
    with extra_cluster(env, "inbox-users", 32, database="postgres") as a, \
            extra_cluster(env, "inbox-mail", 33, database="postgres") as b:
        for c, db in ((a, "users"), (b, "mail")):
            admin = pg_connect(c)
            query(admin, f"CREATE DATABASE {db}")
            set_system(admin, "outbox.databases", db)
            admin.close()
        registrations_to_mail(env, a, b, plan, seed, "two clusters")
