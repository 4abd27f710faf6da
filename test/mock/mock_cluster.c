/*
 * mock_cluster - run librdkafka's mock Kafka cluster as a standalone process
 * for fault-injection tests of the outbox relay.
 *
 * The mock must never run inside postgres (its threads do not block signals,
 * see kafka-notes.md section 2), hence this separate process.
 *
 * Usage: mock_cluster [--brokers N] [--topic NAME:PARTITIONS[:RF] ...]
 *                     [--debug CONTEXTS]   (librdkafka debug, e.g. "mock")
 *
 * Prints exactly one line "BOOTSTRAP host:port,host:port,..." to stdout, then
 * reads commands from stdin, one per line, and answers each with exactly one
 * line "OK" or "ERR <reason>".  Commands:
 *
 *   topic NAME PARTITIONS [RF]         create a topic (RF default min(3,N))
 *   down BROKER|all                    rd_kafka_mock_broker_set_down
 *   up BROKER|all                      rd_kafka_mock_broker_set_up
 *   rtt BROKER|all MS                  rd_kafka_mock_broker_set_rtt
 *   err APIKEY CNT ERR...              rd_kafka_mock_push_request_errors
 *                                      (CNT must equal the number of ERRs)
 *   clearerr APIKEY                    rd_kafka_mock_clear_request_errors
 *   brokererr BROKER APIKEY ERR:MS...  rd_kafka_mock_broker_push_request_error_rtts
 *   leader TOPIC PARTITION BROKER      rd_kafka_mock_partition_set_leader (-1 = none)
 *   follower TOPIC PARTITION BROKER    rd_kafka_mock_partition_set_follower
 *   topicerr TOPIC ERR                 rd_kafka_mock_topic_set_error (NO_ERROR clears)
 *   ping                               answers OK
 *   quit                               destroy the cluster and exit 0
 *
 * APIKEY: a Kafka request name (Produce, Metadata, InitProducerId, ...,
 * case-insensitive) or a number.  ERR: an RD_KAFKA_RESP_ERR_* name with or
 * without that prefix (NOT_ENOUGH_REPLICAS, _TRANSPORT, ...) or a number.
 * Blank lines and lines starting with '#' are ignored (no answer).
 *
 * EOF on stdin, SIGINT and SIGTERM also destroy the cluster and exit 0.
 * Signals are blocked before any librdkafka thread is created (threads inherit
 * the mask) and are received on the main thread via signalfd.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>

#define MAX_ARGS 256
#define LINE_MAX_LEN 8192

static rd_kafka_t *rk;
static rd_kafka_mock_cluster_t *mcluster;
static int broker_cnt = 3;

/* Kafka protocol ApiKeys 0..67 (names as in the Kafka protocol guide). */
static const char *const apikey_names[] = {
    "Produce", "Fetch", "ListOffsets", "Metadata", "LeaderAndIsr",
    "StopReplica", "UpdateMetadata", "ControlledShutdown", "OffsetCommit",
    "OffsetFetch", "FindCoordinator", "JoinGroup", "Heartbeat", "LeaveGroup",
    "SyncGroup", "DescribeGroups", "ListGroups", "SaslHandshake",
    "ApiVersions", "CreateTopics", "DeleteTopics", "DeleteRecords",
    "InitProducerId", "OffsetForLeaderEpoch", "AddPartitionsToTxn",
    "AddOffsetsToTxn", "EndTxn", "WriteTxnMarkers", "TxnOffsetCommit",
    "DescribeAcls", "CreateAcls", "DeleteAcls", "DescribeConfigs",
    "AlterConfigs", "AlterReplicaLogDirs", "DescribeLogDirs",
    "SaslAuthenticate", "CreatePartitions", "CreateDelegationToken",
    "RenewDelegationToken", "ExpireDelegationToken",
    "DescribeDelegationToken", "DeleteGroups", "ElectLeaders",
    "IncrementalAlterConfigs", "AlterPartitionReassignments",
    "ListPartitionReassignments", "OffsetDelete", "DescribeClientQuotas",
    "AlterClientQuotas", "DescribeUserScramCredentials",
    "AlterUserScramCredentials", "Vote", "BeginQuorumEpoch",
    "EndQuorumEpoch", "DescribeQuorum", "AlterPartition", "UpdateFeatures",
    "Envelope", "FetchSnapshot", "DescribeCluster", "DescribeProducers",
    "BrokerRegistration", "BrokerHeartbeat", "UnregisterBroker",
    "DescribeTransactions", "ListTransactions", "AllocateProducerIds",
};
#define APIKEY_CNT ((int)(sizeof(apikey_names) / sizeof(apikey_names[0])))

static char errbuf[512];

static const char *fail(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));

static const char *fail(const char *fmt, ...) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(errbuf, sizeof(errbuf), fmt, ap);
        va_end(ap);
        return errbuf;
}

static int parse_long(const char *s, long min, long max, long *out) {
        char *end;
        long v;
        errno = 0;
        v     = strtol(s, &end, 10);
        if (errno || end == s || *end || v < min || v > max)
                return -1;
        *out = v;
        return 0;
}

static int parse_apikey(const char *s, int16_t *out) {
        long v;
        int i;
        if (!parse_long(s, 0, 32767, &v)) {
                *out = (int16_t)v;
                return 0;
        }
        for (i = 0; i < APIKEY_CNT; i++) {
                if (!strcasecmp(s, apikey_names[i])) {
                        *out = (int16_t)i;
                        return 0;
                }
        }
        return -1;
}

static int parse_err(const char *s, rd_kafka_resp_err_t *out) {
        const struct rd_kafka_err_desc *descs;
        size_t cnt, i;
        long v;

        if (!strncasecmp(s, "RD_KAFKA_RESP_ERR_", 18))
                s += 18;
        if (!parse_long(s, -200, 32767, &v)) {
                *out = (rd_kafka_resp_err_t)v;
                return 0;
        }
        rd_kafka_get_err_descs(&descs, &cnt);
        for (i = 0; i < cnt; i++) {
                if (descs[i].name && !strcasecmp(s, descs[i].name)) {
                        *out = descs[i].code;
                        return 0;
                }
        }
        return -1;
}

/* Broker id or "all" (-> *all = 1). */
static int parse_broker(const char *s, int allow_all, int32_t *id, int *all) {
        long v;
        *all = 0;
        if (allow_all && !strcasecmp(s, "all")) {
                *all = 1;
                return 0;
        }
        if (parse_long(s, -1, 1 << 30, &v))
                return -1;
        *id = (int32_t)v;
        return 0;
}

static int32_t default_rf(void) {
        return broker_cnt < 3 ? broker_cnt : 3;
}

static const char *create_topic(const char *name, const char *parts_s,
                                const char *rf_s) {
        long parts, rf = default_rf();
        rd_kafka_resp_err_t err;

        if (!*name)
                return fail("empty topic name");
        if (parse_long(parts_s, 1, 100000, &parts))
                return fail("bad partition count '%s'", parts_s);
        if (rf_s && parse_long(rf_s, 1, broker_cnt, &rf))
                return fail("bad replication factor '%s' (1..%d)", rf_s,
                            broker_cnt);
        err = rd_kafka_mock_topic_create(mcluster, name, (int)parts, (int)rf);
        if (err)
                return fail("%s", rd_kafka_err2name(err));
        return NULL;
}

typedef rd_kafka_resp_err_t (*broker_fn)(rd_kafka_mock_cluster_t *, int32_t);

static const char *updown(int argc, char **argv, broker_fn fn) {
        int32_t id = 0;
        int all, b;
        rd_kafka_resp_err_t err;

        if (argc != 2)
                return fail("usage: %s BROKER|all", argv[0]);
        if (parse_broker(argv[1], 1, &id, &all))
                return fail("bad broker id '%s'", argv[1]);
        if (!all) {
                if ((err = fn(mcluster, id)))
                        return fail("broker %d: %s", (int)id,
                                    rd_kafka_err2name(err));
                return NULL;
        }
        for (b = 1; b <= broker_cnt; b++)
                if ((err = fn(mcluster, b)))
                        return fail("broker %d: %s", b,
                                    rd_kafka_err2name(err));
        return NULL;
}

static const char *cmd_rtt(int argc, char **argv) {
        int32_t id = 0;
        int all, b;
        long ms;
        rd_kafka_resp_err_t err;

        if (argc != 3)
                return fail("usage: rtt BROKER|all MS");
        if (parse_broker(argv[1], 1, &id, &all))
                return fail("bad broker id '%s'", argv[1]);
        if (parse_long(argv[2], 0, 3600 * 1000, &ms))
                return fail("bad rtt '%s'", argv[2]);
        for (b = all ? 1 : id; b <= (all ? broker_cnt : id); b++)
                if ((err = rd_kafka_mock_broker_set_rtt(mcluster, b, (int)ms)))
                        return fail("broker %d: %s", b,
                                    rd_kafka_err2name(err));
        return NULL;
}

static const char *cmd_err(int argc, char **argv) {
        int16_t apikey;
        long cnt;
        rd_kafka_resp_err_t errs[MAX_ARGS];
        int i;

        if (argc < 4)
                return fail("usage: err APIKEY CNT ERRNAME...");
        if (parse_apikey(argv[1], &apikey))
                return fail("unknown ApiKey '%s'", argv[1]);
        if (parse_long(argv[2], 1, MAX_ARGS, &cnt))
                return fail("bad count '%s'", argv[2]);
        if (cnt != argc - 3)
                return fail("count %ld does not match %d error names", cnt,
                            argc - 3);
        for (i = 0; i < cnt; i++)
                if (parse_err(argv[3 + i], &errs[i]))
                        return fail("unknown error '%s'", argv[3 + i]);
        rd_kafka_mock_push_request_errors_array(mcluster, apikey, (size_t)cnt,
                                                errs);
        return NULL;
}

static const char *cmd_clearerr(int argc, char **argv) {
        int16_t apikey;
        if (argc != 2)
                return fail("usage: clearerr APIKEY");
        if (parse_apikey(argv[1], &apikey))
                return fail("unknown ApiKey '%s'", argv[1]);
        rd_kafka_mock_clear_request_errors(mcluster, apikey);
        return NULL;
}

static const char *cmd_brokererr(int argc, char **argv) {
        int32_t id = 0;
        int all, i;
        int16_t apikey;
        rd_kafka_resp_err_t errs[MAX_ARGS];
        int rtts[MAX_ARGS];
        rd_kafka_resp_err_t err;

        if (argc < 4)
                return fail("usage: brokererr BROKER APIKEY ERRNAME:RTT_MS...");
        if (parse_broker(argv[1], 0, &id, &all))
                return fail("bad broker id '%s'", argv[1]);
        if (parse_apikey(argv[2], &apikey))
                return fail("unknown ApiKey '%s'", argv[2]);
        /* Validate everything before pushing anything. */
        for (i = 3; i < argc; i++) {
                char *colon = strrchr(argv[i], ':');
                long ms     = 0;
                if (colon) {
                        *colon = '\0';
                        if (parse_long(colon + 1, 0, 3600 * 1000, &ms))
                                return fail("bad rtt in '%s:%s'", argv[i],
                                            colon + 1);
                }
                if (parse_err(argv[i], &errs[i - 3]))
                        return fail("unknown error '%s'", argv[i]);
                rtts[i - 3] = (int)ms;
        }
        /* The API is variadic only; pushing one tuple at a time appends to
         * the broker's per-ApiKey error stack in order. */
        for (i = 0; i < argc - 3; i++)
                if ((err = rd_kafka_mock_broker_push_request_error_rtts(
                         mcluster, id, apikey, 1, errs[i], rtts[i])))
                        return fail("broker %d: %s", (int)id,
                                    rd_kafka_err2name(err));
        return NULL;
}

static const char *cmd_partition(int argc, char **argv, int follower) {
        long part, b;
        rd_kafka_resp_err_t err;

        if (argc != 4)
                return fail("usage: %s TOPIC PARTITION BROKER", argv[0]);
        if (parse_long(argv[2], 0, 1 << 30, &part))
                return fail("bad partition '%s'", argv[2]);
        if (parse_long(argv[3], -1, 1 << 30, &b))
                return fail("bad broker id '%s'", argv[3]);
        if (follower)
                err = rd_kafka_mock_partition_set_follower(
                    mcluster, argv[1], (int32_t)part, (int32_t)b);
        else
                err = rd_kafka_mock_partition_set_leader(
                    mcluster, argv[1], (int32_t)part, (int32_t)b);
        if (err)
                return fail("%s", rd_kafka_err2name(err));
        return NULL;
}

static const char *cmd_topicerr(int argc, char **argv) {
        rd_kafka_resp_err_t err;
        if (argc != 3)
                return fail("usage: topicerr TOPIC ERRNAME");
        if (parse_err(argv[2], &err))
                return fail("unknown error '%s'", argv[2]);
        rd_kafka_mock_topic_set_error(mcluster, argv[1], err);
        return NULL;
}

/* Returns NULL on success, else the error text; sets *quit on "quit". */
static const char *run_command(char *line, int *quit) {
        char *argv[MAX_ARGS + 4];
        int argc = 0;
        char *save, *tok;

        for (tok = strtok_r(line, " \t\r", &save); tok;
             tok = strtok_r(NULL, " \t\r", &save)) {
                if (argc == MAX_ARGS + 3)
                        return fail("too many arguments");
                argv[argc++] = tok;
        }
        argv[argc] = NULL;

        if (!strcmp(argv[0], "quit") || !strcmp(argv[0], "exit")) {
                *quit = 1;
                return NULL;
        }
        if (!strcmp(argv[0], "ping"))
                return NULL;
        if (!strcmp(argv[0], "topic")) {
                if (argc != 3 && argc != 4)
                        return fail("usage: topic NAME PARTITIONS [RF]");
                return create_topic(argv[1], argv[2],
                                    argc == 4 ? argv[3] : NULL);
        }
        if (!strcmp(argv[0], "down"))
                return updown(argc, argv, rd_kafka_mock_broker_set_down);
        if (!strcmp(argv[0], "up"))
                return updown(argc, argv, rd_kafka_mock_broker_set_up);
        if (!strcmp(argv[0], "rtt"))
                return cmd_rtt(argc, argv);
        if (!strcmp(argv[0], "err"))
                return cmd_err(argc, argv);
        if (!strcmp(argv[0], "clearerr"))
                return cmd_clearerr(argc, argv);
        if (!strcmp(argv[0], "brokererr"))
                return cmd_brokererr(argc, argv);
        if (!strcmp(argv[0], "leader"))
                return cmd_partition(argc, argv, 0);
        if (!strcmp(argv[0], "follower"))
                return cmd_partition(argc, argv, 1);
        if (!strcmp(argv[0], "topicerr"))
                return cmd_topicerr(argc, argv);
        return fail("unknown command '%s'", argv[0]);
}

/* Returns 0 to continue, 1 to quit, -1 if stdout is gone. */
static int handle_line(char *line) {
        const char *err;
        int quit = 0;
        char *p  = line;

        while (*p == ' ' || *p == '\t' || *p == '\r')
                p++;
        if (!*p || *p == '#')
                return 0;
        err = run_command(p, &quit);
        if (err)
                printf("ERR %s\n", err);
        else
                printf("OK\n");
        if (fflush(stdout) != 0)
                return -1;
        return quit;
}

static void usage(const char *me) {
        fprintf(stderr,
                "usage: %s [--brokers N] [--topic NAME:PARTITIONS[:RF] ...] "
                "[--debug CONTEXTS]\n",
                me);
        exit(2);
}

int main(int argc, char **argv) {
        char errstr[512];
        rd_kafka_conf_t *conf;
        sigset_t sigs;
        int sfd, i, rc = 0;
        char *topics[MAX_ARGS];
        int topic_cnt = 0;
        static char buf[LINE_MAX_LEN];
        size_t len = 0;
        int discarding = 0;
        const char *debug = NULL;

        for (i = 1; i < argc; i++) {
                long v;
                if (!strcmp(argv[i], "--brokers") && i + 1 < argc) {
                        if (parse_long(argv[++i], 1, 1000, &v))
                                usage(argv[0]);
                        broker_cnt = (int)v;
                } else if (!strncmp(argv[i], "--brokers=", 10)) {
                        if (parse_long(argv[i] + 10, 1, 1000, &v))
                                usage(argv[0]);
                        broker_cnt = (int)v;
                } else if (!strcmp(argv[i], "--debug") && i + 1 < argc) {
                        debug = argv[++i];
                } else if (!strcmp(argv[i], "--topic") && i + 1 < argc &&
                           topic_cnt < MAX_ARGS) {
                        topics[topic_cnt++] = argv[++i];
                } else if (!strncmp(argv[i], "--topic=", 8) &&
                           topic_cnt < MAX_ARGS) {
                        topics[topic_cnt++] = argv[i] + 8;
                } else {
                        usage(argv[0]);
                }
        }

        /* Block SIGINT/SIGTERM/SIGHUP before librdkafka creates any thread:
         * all threads inherit the mask, and the main thread reads them from
         * a signalfd.  SIGPIPE is ignored so a vanished reader gives EPIPE. */
        sigemptyset(&sigs);
        sigaddset(&sigs, SIGINT);
        sigaddset(&sigs, SIGTERM);
        sigaddset(&sigs, SIGHUP);
        if (sigprocmask(SIG_BLOCK, &sigs, NULL) == -1) {
                perror("sigprocmask");
                return 1;
        }
        signal(SIGPIPE, SIG_IGN);
        sfd = signalfd(-1, &sigs, SFD_CLOEXEC);
        if (sfd == -1) {
                perror("signalfd");
                return 1;
        }

        /* Dummy producer handle that owns the mock cluster. */
        conf = rd_kafka_conf_new();
        /* log_level 4 hides the harmless "No bootstrap.servers" notice */
        if (rd_kafka_conf_set(conf, "client.id", "outbox-mock-cluster", errstr,
                              sizeof(errstr)) != RD_KAFKA_CONF_OK ||
            rd_kafka_conf_set(conf, "log_level", debug ? "7" : "4", errstr,
                              sizeof(errstr)) != RD_KAFKA_CONF_OK ||
            (debug && rd_kafka_conf_set(conf, "debug", debug, errstr,
                                        sizeof(errstr)) != RD_KAFKA_CONF_OK)) {
                fprintf(stderr, "mock_cluster: %s\n", errstr);
                return 1;
        }
        rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, errstr, sizeof(errstr));
        if (!rk) {
                fprintf(stderr, "mock_cluster: rd_kafka_new: %s\n", errstr);
                return 1;
        }
        mcluster = rd_kafka_mock_cluster_new(rk, broker_cnt);
        if (!mcluster) {
                fprintf(stderr, "mock_cluster: failed to create mock cluster\n");
                rd_kafka_destroy(rk);
                return 1;
        }

        for (i = 0; i < topic_cnt; i++) {
                char *name  = topics[i];
                char *parts = strchr(name, ':');
                char *rf;
                const char *err;
                if (!parts) {
                        fprintf(stderr, "mock_cluster: --topic %s: "
                                        "expected NAME:PARTITIONS[:RF]\n",
                                name);
                        rc = 2;
                        goto out;
                }
                *parts++ = '\0';
                if ((rf = strchr(parts, ':')))
                        *rf++ = '\0';
                if ((err = create_topic(name, parts, rf))) {
                        fprintf(stderr, "mock_cluster: --topic %s: %s\n", name,
                                err);
                        rc = 2;
                        goto out;
                }
        }

        printf("BOOTSTRAP %s\n", rd_kafka_mock_cluster_bootstraps(mcluster));
        if (fflush(stdout) != 0)
                goto out;

        for (;;) {
                struct pollfd pfd[2] = {{.fd = STDIN_FILENO, .events = POLLIN},
                                        {.fd = sfd, .events = POLLIN}};
                ssize_t r;
                char *nl;

                if (poll(pfd, 2, -1) == -1) {
                        if (errno == EINTR)
                                continue;
                        perror("poll");
                        rc = 1;
                        break;
                }
                if (pfd[1].revents & POLLIN) {
                        struct signalfd_siginfo si;
                        if (read(sfd, &si, sizeof(si)) == (ssize_t)sizeof(si))
                                fprintf(stderr,
                                        "mock_cluster: got signal %u, "
                                        "exiting\n",
                                        si.ssi_signo);
                        break;
                }
                if (!(pfd[0].revents & (POLLIN | POLLHUP | POLLERR)))
                        continue;

                r = read(STDIN_FILENO, buf + len, sizeof(buf) - 1 - len);
                if (r == -1 && (errno == EINTR || errno == EAGAIN))
                        continue;
                if (r <= 0) {
                        /* EOF: a last unterminated line is still executed */
                        if (len > 0 && !discarding) {
                                buf[len] = '\0';
                                handle_line(buf);
                        }
                        break;
                }
                len += (size_t)r;

                while ((nl = memchr(buf, '\n', len))) {
                        size_t linelen = (size_t)(nl - buf);
                        int res        = 0;
                        *nl            = '\0';
                        if (discarding) {
                                discarding = 0;
                                printf("ERR line too long\n");
                                if (fflush(stdout) != 0)
                                        res = -1;
                        } else {
                                res = handle_line(buf);
                        }
                        memmove(buf, nl + 1, len - linelen - 1);
                        len -= linelen + 1;
                        if (res != 0)
                                goto out;
                }
                if (len == sizeof(buf) - 1) {
                        /* overlong line: drop it, answer at its end */
                        discarding = 1;
                        len        = 0;
                }
        }

out:
        rd_kafka_mock_cluster_destroy(mcluster);
        rd_kafka_destroy(rk);
        close(sfd);
        return rc;
}
