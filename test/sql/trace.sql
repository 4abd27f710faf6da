--
-- W3C trace context: emit() and capture() add traceparent (and tracestate)
-- headers taken from, in this order, the event's own headers, the settings
-- outbox.traceparent/outbox.tracestate, or the statement's sqlcommenter
-- comment.  A malformed setting or comment is ignored; a malformed header
-- given to emit() is an error.
--
\set SHOW_CONTEXT never
CREATE EXTENSION outbox;
CREATE FUNCTION trace_headers(agg text) RETURNS jsonb LANGUAGE sql
    AS $$ SELECT headers FROM outbox.events WHERE aggregate_id = agg $$;

-- no context anywhere: no headers at all
SELECT outbox.emit('trace', 'none', 'x', '{}') IS NOT NULL AS ok;
SELECT trace_headers('none');

-- the statement's sqlcommenter comment (values URL-encoded)
SELECT outbox.emit('trace', 'comment', 'x', '{}') IS NOT NULL AS ok /*action='checkout',traceparent='00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01',tracestate='congo%3Dt61rcWkgMzE%2Crojo%3D00f067aa0ba902b7'*/;
SELECT trace_headers('comment');
-- the user's other headers are kept
SELECT outbox.emit('trace', 'comment+headers', 'x', '{}', '{"tenant": "acme"}') IS NOT NULL AS ok /*traceparent='00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'*/;
SELECT trace_headers('comment+headers');
-- a malformed comment changes nothing, and fails nothing
SELECT outbox.emit('trace', 'bad comment', 'x', '{}') IS NOT NULL AS ok /*traceparent='00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01'*/;
SELECT outbox.emit('trace', 'zero trace id', 'x', '{}') IS NOT NULL AS ok /*traceparent='00-00000000000000000000000000000000-b7ad6b7169203331-01'*/;
SELECT outbox.emit('trace', 'unclosed', 'x', '{}') IS NOT NULL AS ok /*traceparent='00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01*/;
SELECT trace_headers('bad comment') AS bad, trace_headers('zero trace id') AS zero,
       trace_headers('unclosed') AS unclosed;
-- what only looks like a comment is data: in a literal, a quoted name, a dollar quote, a -- comment
SELECT outbox.emit('trace', 'in literal', 'x', '{"t": "/*traceparent=''00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01''*/"}') IS NOT NULL AS ok;
SELECT outbox.emit('trace', 'in e-literal', 'x', jsonb_build_object('t', E'it\'s /*traceparent=''00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01''*/')) IS NOT NULL AS "/*traceparent='00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'*/";
SELECT outbox.emit('trace', 'in dollar quote', 'x', jsonb_build_object('t', $q$ /*traceparent='00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'*/ $q$)) IS NOT NULL AS ok;
SELECT trace_headers('in literal') AS literal, trace_headers('in e-literal') AS e_literal,
       trace_headers('in dollar quote') AS dollar;
-- ... and a real comment after such text is found; a nested comment is one comment, not of
-- sqlcommenter's shape: ignored
SELECT outbox.emit('trace', 'after literal', 'x', '{"t": "it''s /*"}') IS NOT NULL AS ok /*traceparent='00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'*/;
SELECT outbox.emit('trace', 'nested', 'x', '{}') IS NOT NULL AS ok /* outer /* inner */ traceparent='00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01' */;
SELECT trace_headers('after literal') AS after_literal, trace_headers('nested') AS nested;

-- a valid traceparent with a malformed tracestate: the tracestate is dropped
SELECT outbox.emit('trace', 'bad tracestate', 'x', '{}') IS NOT NULL AS ok /*traceparent='00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01',tracestate='Not=Valid'*/;
SELECT trace_headers('bad tracestate');

-- SET LOCAL outbox.traceparent wins over the comment
BEGIN;
SET LOCAL outbox.traceparent = '00-11111111111111111111111111111111-2222222222222222-01';
SET LOCAL outbox.tracestate = 'vendor=abc';
SELECT outbox.emit('trace', 'setting', 'x', '{}') IS NOT NULL AS ok /*traceparent='00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'*/;
COMMIT;
SELECT trace_headers('setting');
SHOW outbox.traceparent;
-- a malformed setting is ignored: the comment's context is used
BEGIN;
SET LOCAL outbox.traceparent = 'garbage';
SELECT outbox.emit('trace', 'bad setting', 'x', '{}') IS NOT NULL AS ok /*traceparent='00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'*/;
SELECT outbox.emit('trace', 'bad setting only', 'x', '{}') IS NOT NULL AS ok;
COMMIT;
SELECT trace_headers('bad setting') AS from_comment, trace_headers('bad setting only') AS none;

-- the event's own traceparent wins over both; the setting's tracestate does
-- not go with it
BEGIN;
SET LOCAL outbox.traceparent = '00-11111111111111111111111111111111-2222222222222222-01';
SET LOCAL outbox.tracestate = 'vendor=abc';
SELECT outbox.emit('trace', 'explicit', 'x', '{}',
                   '{"traceparent": "00-33333333333333333333333333333333-4444444444444444-00"}') IS NOT NULL AS ok;
COMMIT;
SELECT trace_headers('explicit');
-- a later version may carry more fields (W3C forward compatibility)
SELECT outbox.emit('trace', 'version 01', 'x', '{}',
                   '{"traceparent": "01-33333333333333333333333333333333-4444444444444444-00-extra"}') IS NOT NULL AS ok;

-- a malformed traceparent or tracestate in headers is an error
SELECT outbox.emit('trace', 'e1', 'x', '{}', '{"traceparent": "00-abc-def-01"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT outbox.emit('trace', 'e2', 'x', '{}',
                   '{"traceparent": "00-33333333333333333333333333333333-0000000000000000-00"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT outbox.emit('trace', 'e3', 'x', '{}',
                   '{"traceparent": "ff-33333333333333333333333333333333-4444444444444444-00"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT outbox.emit('trace', 'e4', 'x', '{}',
                   '{"traceparent": "00-33333333333333333333333333333333-4444444444444444-00-x"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT outbox.emit('trace', 'e5', 'x', '{}', '{"traceparent": "00-33333333333333333333333333333333-4444444444444444-00", "tracestate": "a=b,,c=d e"}') IS NOT NULL AS ok;
SELECT outbox.emit('trace', 'e6', 'x', '{}', '{"traceparent": "00-33333333333333333333333333333333-4444444444444444-00", "tracestate": "a=b=c"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- a tracestate without its traceparent is refused (it would be paired with another source's)
SELECT outbox.emit('trace', 'e8', 'x', '{}', '{"tracestate": "a=b"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
-- a %00 in a comment's value makes it malformed: dropped, never cut short
SELECT outbox.emit('trace', 'nul', 'x', '{}') IS NOT NULL AS ok /*traceparent='00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01',tracestate='a%3Db%00c'*/;
SELECT trace_headers('nul');
-- ce_id and ce_specversion are the relay's, as id is
SELECT outbox.emit('trace', 'e7', 'x', '{}', '{"ce_id": "mine"}');
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT count(*) AS written FROM outbox.events WHERE aggregate_id LIKE 'e_';

-- capture() takes the context of the client's statement
CREATE TABLE traced (id int PRIMARY KEY, v text);
CREATE TRIGGER traced_outbox AFTER INSERT OR UPDATE ON traced
    FOR EACH ROW EXECUTE FUNCTION outbox.capture('traced', 'id');
INSERT INTO traced SELECT g, 'v' FROM generate_series(1, 3) g /*traceparent='00-55555555555555555555555555555555-6666666666666666-01'*/;
UPDATE traced SET v = 'w' WHERE id = 1;
SELECT aggregate_id, event_type, headers FROM outbox.events
 WHERE aggregate_type = 'traced' ORDER BY id;

-- a function's emit() sees the statement that called it
CREATE FUNCTION place(agg text) RETURNS void LANGUAGE plpgsql
    AS $$ BEGIN PERFORM outbox.emit('trace', agg, 'x', '{}'); END $$;
SELECT place('via function') /*traceparent='00-77777777777777777777777777777777-8888888888888888-01'*/;
SELECT trace_headers('via function');

DROP FUNCTION place(text);
DROP FUNCTION trace_headers(text);
DROP TABLE traced;
DROP EXTENSION outbox;
