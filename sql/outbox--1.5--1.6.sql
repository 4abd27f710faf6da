/*
 * outbox--1.5--1.6.sql: the consumers' formats (issue 13).
 *
 * Adds outbox.emit_bytes(), whose payload of bytes the relay sends
 * unchanged, and the column payload_bytes of outbox.events that holds it
 * (NULL for every other event: adding it rewrites nothing).  emit()'s
 * comment names the new reserved headers and the trace context it adds;
 * the CloudEvents format and the trace context need no schema change.
 */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION outbox UPDATE TO '1.6'" to load this file. \quit

ALTER TABLE outbox.events ADD COLUMN payload_bytes bytea;

COMMENT ON COLUMN outbox.events.payload IS
'Kafka message value, sent as JSON text. NULL (and payload_bytes NULL) sends a tombstone (a message with a NULL value) for compacted topics.';
COMMENT ON COLUMN outbox.events.payload_bytes IS
'Kafka message value of an event written by outbox.emit_bytes(), sent byte for byte (payload is then NULL); NULL for the events of emit() and capture().';

CREATE FUNCTION outbox.emit_bytes(aggregate_type text,
                                  aggregate_id text,
                                  event_type text,
                                  payload bytea,
                                  headers jsonb DEFAULT NULL,
                                  topic text DEFAULT NULL)
RETURNS uuid
AS 'MODULE_PATHNAME', 'outbox_emit_bytes'
LANGUAGE C VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp;

COMMENT ON FUNCTION outbox.emit_bytes(text, text, text, bytea, jsonb, text) IS
'As outbox.emit(), with a payload of bytes the relay sends unchanged as the Kafka message value (e.g. Avro or Protobuf in the Confluent wire format: magic byte, schema id, data). NULL sends a tombstone. Same arguments, checks, errors (22004, 22023, 42501), ordering, dead letters, replay and status as emit(); in outbox.message_format = cloudevents the content-type header is application/octet-stream unless headers give one. Returns the event_id (uuid). Callers need EXECUTE (not granted to PUBLIC).';

COMMENT ON FUNCTION outbox.emit(text, text, text, jsonb, jsonb, text) IS
'Writes one event into outbox.events in the current transaction and returns its event_id (uuid). The relay publishes it to Kafka only if the transaction commits. aggregate_type, aggregate_id and event_type must be non-empty; headers must be a JSON object of string values (keys id, event_type, aggregate_type, ce_id, ce_specversion are reserved; other ce_* keys must be CloudEvents attributes a consumer can read; a traceparent or tracestate must be well-formed W3C trace context, a tracestate only with a traceparent; without a traceparent, the one of SET outbox.traceparent or of the statement''s sqlcommenter comment is added); topic, or outbox.topic_prefix || aggregate_type when topic is NULL, must be a legal Kafka topic name (1-249 of [a-zA-Z0-9._-], not "." or "..") and allowed by outbox.allowed_topics. Runs as the extension owner: callers need EXECUTE only (not granted to PUBLIC). Errors: 22004 for a NULL argument, 22023 for any other invalid argument, 42501 for a topic outbox.allowed_topics does not allow.';

REVOKE ALL ON FUNCTION outbox.emit_bytes(text, text, text, bytea, jsonb, text) FROM PUBLIC;

/*
 * Initial privileges (rule 4 of outbox.sql).  The GRANTs and REVOKEs above
 * stored each object's ACL in pg_init_privs.  For the function this script
 * created that is the owner's items and pg_monitor's, unless the installing
 * role has default privileges (ALTER DEFAULT PRIVILEGES).  And
 * schema outbox may exist before CREATE EXTENSION (DROP EXTENSION leaves it,
 * with the users' grants, and pg_restore creates it first).  So reset them,
 * as every update path to this version does: the owner's items, and
 * pg_monitor's USAGE on the schema, EXECUTE on worker_status() and
 * cluster_status() and SELECT on status; no user's, no PUBLIC's.
 */
DO $$
DECLARE
    r record;
    acl pg_catalog.aclitem[];
    keep pg_catalog.oid[];
BEGIN
    FOR r IN
        SELECT ip.classoid, ip.objoid, ip.objsubid, ip.initprivs, m.priv,
               CASE ip.classoid
                   WHEN 'pg_catalog.pg_class'::pg_catalog.regclass THEN
                       (SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = ip.objoid)
                   WHEN 'pg_catalog.pg_proc'::pg_catalog.regclass THEN
                       (SELECT p.proowner FROM pg_catalog.pg_proc p WHERE p.oid = ip.objoid)
                   WHEN 'pg_catalog.pg_namespace'::pg_catalog.regclass THEN
                       (SELECT n.nspowner FROM pg_catalog.pg_namespace n WHERE n.oid = ip.objoid)
               END AS owner
          FROM pg_catalog.pg_init_privs ip
          LEFT JOIN (VALUES ('pg_catalog.pg_namespace'::pg_catalog.regclass,
                             'outbox'::pg_catalog.regnamespace::pg_catalog.oid, 'USAGE'),
                            ('pg_catalog.pg_proc', 'outbox.worker_status()'::pg_catalog.regprocedure, 'EXECUTE'),
                            ('pg_catalog.pg_proc', 'outbox.cluster_status()'::pg_catalog.regprocedure, 'EXECUTE'),
                            ('pg_catalog.pg_class', 'outbox.status'::pg_catalog.regclass, 'SELECT'))
                 AS m(classoid, objoid, priv)
            ON m.classoid = ip.classoid AND m.objoid = ip.objoid AND ip.objsubid = 0
         WHERE (ip.classoid, ip.objoid) IN
               (SELECT d.classid, d.objid FROM pg_catalog.pg_depend d
                 WHERE d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass
                   AND d.refobjid = (SELECT e.oid FROM pg_catalog.pg_extension e
                                      WHERE e.extname = 'outbox')
                   AND d.deptype = 'e')
            OR (ip.classoid = 'pg_catalog.pg_namespace'::pg_catalog.regclass
                AND ip.objoid = 'outbox'::pg_catalog.regnamespace)
    LOOP
        -- the owner's items, in their order (columns have none: their rows go)
        acl := ARRAY(SELECT u.a FROM pg_catalog.unnest(r.initprivs) WITH ORDINALITY AS u(a, n)
                      WHERE (SELECT x.grantee FROM pg_catalog.aclexplode(ARRAY[u.a]) AS x LIMIT 1) = r.owner
                      ORDER BY u.n);
        IF r.priv IS NOT NULL THEN
            acl := pg_catalog.array_append(acl,
                pg_catalog.makeaclitem('pg_monitor'::pg_catalog.regrole, r.owner, r.priv, false));
        END IF;
        IF pg_catalog.cardinality(acl) = 0 THEN   -- aclexplode() refuses '{}'
            keep := '{}';
        ELSE
            keep := ARRAY(SELECT x.grantee FROM pg_catalog.aclexplode(acl) AS x
                          UNION SELECT x.grantor FROM pg_catalog.aclexplode(acl) AS x);
        END IF;
        -- PostgreSQL 17 records the roles named in pg_init_privs in pg_shdepend
        -- (deptype 'i'): drop those of the items removed, or the roles could
        -- never be dropped.  Before 17 there are no such rows.
        DELETE FROM pg_catalog.pg_shdepend sd
         WHERE sd.deptype = 'i'
           AND sd.dbid = (SELECT d.oid FROM pg_catalog.pg_database d
                           WHERE d.datname = pg_catalog.current_database())
           AND sd.classid = r.classoid AND sd.objid = r.objoid AND sd.objsubid = r.objsubid
           AND sd.refclassid = 'pg_catalog.pg_authid'::pg_catalog.regclass
           AND sd.refobjid <> ALL (keep);
        IF pg_catalog.cardinality(acl) = 0 THEN
            DELETE FROM pg_catalog.pg_init_privs
             WHERE classoid = r.classoid AND objoid = r.objoid AND objsubid = r.objsubid;
        ELSE
            UPDATE pg_catalog.pg_init_privs SET initprivs = acl
             WHERE classoid = r.classoid AND objoid = r.objoid AND objsubid = r.objsubid;
        END IF;
    END LOOP;
END
$$;
