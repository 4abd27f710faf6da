/*-------------------------------------------------------------------------
 *
 * trace_context.c
 *	  W3C trace context (traceparent, tracestate) for the events emit(),
 *	  emit_bytes() and capture() write, so that a consumer's span can
 *	  continue the trace of the transaction that wrote the event.
 *
 * The context is taken, in this order, from
 *	1. the event's own headers (emit(): checked like any header, a bad one
 *	   is an error);
 *	2. the settings outbox.traceparent and outbox.tracestate, which an
 *	   application's middleware sets with SET LOCAL;
 *	3. the sqlcommenter comment of the statement being run,
 *	   e.g. INSERT ... /\*traceparent='00-...-01'*\/, as OpenTelemetry's
 *	   sqlcommenter integrations add it.
 * A malformed value from 2 or 3 is ignored: the trace is lost, never the
 * business transaction.  The context is written into the event row's
 * headers, so the relay, replay and dead letters carry it unchanged.
 *
 * Format: https://www.w3.org/TR/trace-context/ (traceparent version 00, and
 * later versions as its forward-compatibility rules allow).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "write/trace_context.h"
#include "config/guc.h"

#include <ctype.h>

#include "access/xact.h"
#include "parser/parser.h"
#include "tcop/tcopprot.h"
#include "utils/fmgrprotos.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#define TRACEPARENT				"traceparent"
#define TRACESTATE				"tracestate"
#define TRACEPARENT_LEN			55	/* version 00: 2-32-16-2 hex digits */
#define TRACESTATE_MAX_LEN		512
#define TRACESTATE_MAX_MEMBERS	32

/* a character of an identifier (or of a dollar quote's tag) after its first */
#define IS_IDENT_CHAR(c) \
	(isalnum((unsigned char) (c)) || (c) == '_' || (unsigned char) (c) >= 0x80)

/*
 * The context found in the comment of the statement being run, kept for
 * that statement: a trigger capturing 10,000 rows of one INSERT scans its
 * (perhaps long) text once, not once per row.
 */
static const char *comment_query = NULL;
static TimestampTz comment_statement_start = 0;
static char *comment_traceparent = NULL;
static char *comment_tracestate = NULL;

static void find_comment_context(void);
static const char *next_comment(const char *p, const char **body,
								const char **body_end);
static const char *skip_to(const char *p, const char *s);
static const char *skip_literal(const char *p, char quote, bool backslash);
static const char *skip_dollar_quote(const char *p);
static void parse_comment(const char *start, const char *end,
						  char **traceparent, char **tracestate);
static void replace_value(char **target, char *value);
static char *decode_value(const char *start, const char *end);
static bool is_lower_hex(const char *s, int n, bool *all_zero);
static bool tracestate_member_is_valid(const char *s, const char *end);
static Jsonb *add_headers(Jsonb *headers, const char *traceparent,
						  const char *tracestate);

/*
 * outbox_traceparent_is_valid
 *		Is s a W3C traceparent: "00-<32 hex trace id>-<16 hex parent id>-<2
 *		hex flags>" in lower case, trace and parent id not all zeros?  A
 *		version above 00 may append "-..." after the flags; version ff is
 *		invalid.  Raises no error.
 */
bool
outbox_traceparent_is_valid(const char *s)
{
	size_t		len = strlen(s);
	bool		zero;

	if (len < TRACEPARENT_LEN ||
		!is_lower_hex(s, 2, &zero) || strncmp(s, "ff", 2) == 0 ||
		s[2] != '-' || s[35] != '-' || s[52] != '-')
		return false;
	if (!is_lower_hex(s + 3, 32, &zero) || zero)
		return false;
	if (!is_lower_hex(s + 36, 16, &zero) || zero)
		return false;
	if (!is_lower_hex(s + 53, 2, &zero))
		return false;
	if (strncmp(s, "00", 2) == 0)
		return len == TRACEPARENT_LEN;
	return len == TRACEPARENT_LEN || s[TRACEPARENT_LEN] == '-';
}

/*
 * outbox_tracestate_is_valid
 *		Is s a W3C tracestate: at most 32 comma-separated key=value members
 *		(empty ones allowed), at most 512 bytes; keys of [a-z0-9_*-/@],
 *		starting with a lower-case letter or digit; values of printable
 *		ASCII but ',' and '=', not ending in a space.  Raises no error.
 */
bool
outbox_tracestate_is_valid(const char *s)
{
	int			members = 0;

	if (strlen(s) > TRACESTATE_MAX_LEN)
		return false;
	while (*s != '\0')
	{
		const char *comma = strchr(s, ',');
		const char *end = comma ? comma : s + strlen(s);

		/* optional white space around each member */
		while (s < end && (*s == ' ' || *s == '\t'))
			s++;
		while (end > s && (end[-1] == ' ' || end[-1] == '\t'))
			end--;
		if (s < end &&
			(++members > TRACESTATE_MAX_MEMBERS || !tracestate_member_is_valid(s, end)))
			return false;
		if (comma == NULL)
			break;
		s = comma + 1;
	}
	return true;
}

/* key=value between s and end (trimmed) as outbox_tracestate_is_valid says */
static bool
tracestate_member_is_valid(const char *s, const char *end)
{
	const char *eq = memchr(s, '=', end - s);
	const char *p;

	if (eq == NULL || eq == s || eq + 1 == end ||
		!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9')))
		return false;
	for (p = s; p < eq; p++)
		if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') ||
			  strchr("_-*/@", *p) != NULL))
			return false;
	for (p = eq + 1; p < end; p++)
		if (*p < 0x20 || *p > 0x7e || *p == ',' || *p == '=')
			return false;
	return true;
}

/*
 * outbox_check_trace_header
 *		Raise 22023 if the header key (a C string) is traceparent or
 *		tracestate and value (len bytes, not NUL-terminated) is not a valid
 *		one: given explicitly (emit()'s headers), a bad one is the caller's
 *		to hear about, not a consumer's to drop or misread.  (From a setting
 *		or comment a bad one is ignored instead.)
 */
void
outbox_check_trace_header(const char *key, const char *value, size_t len)
{
	char	   *s;

	if (strcmp(key, TRACEPARENT) != 0 && strcmp(key, TRACESTATE) != 0)
		return;
	s = pnstrdup(value, len);
	if (strcmp(key, TRACEPARENT) == 0 && !outbox_traceparent_is_valid(s))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("headers value for key \"traceparent\" is not a W3C traceparent: \"%s\"", s),
				 errhint("A traceparent is 00-<32 hex digits trace id>-<16 hex digits parent id>-<2 hex digits flags>, in lower case.")));
	if (strcmp(key, TRACESTATE) == 0 && !outbox_tracestate_is_valid(s))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("headers value for key \"tracestate\" is not a W3C tracestate: \"%s\"", s),
				 errhint("A tracestate is up to 32 comma-separated key=value members, at most 512 bytes.")));
	pfree(s);
}

/*
 * outbox_add_trace_context
 *		headers (a flat object of strings, or NULL) with traceparent and
 *		tracestate added from the setting or the statement's comment, when
 *		headers has no traceparent and one of them has a valid one (a
 *		tracestate goes only with the traceparent of its own source, and
 *		never replaces one in headers).  Returns headers itself when nothing
 *		is added, else a new jsonb palloc'd in the current context.  Raises
 *		no error of its own.
 */
Jsonb *
outbox_add_trace_context(Jsonb *headers)
{
	const char *traceparent = NULL;
	const char *tracestate = NULL;
	JsonbValue	v;

	if (headers != NULL &&
		getKeyJsonValueFromContainer(&headers->root, TRACEPARENT,
									 strlen(TRACEPARENT), &v) != NULL)
		return headers;

	if (outbox_traceparent != NULL && outbox_traceparent[0] != '\0' &&
		outbox_traceparent_is_valid(outbox_traceparent))
	{
		traceparent = outbox_traceparent;
		if (outbox_tracestate != NULL && outbox_tracestate[0] != '\0' &&
			outbox_tracestate_is_valid(outbox_tracestate))
			tracestate = outbox_tracestate;
	}
	else
	{
		find_comment_context();
		traceparent = comment_traceparent;
		tracestate = comment_tracestate;
	}
	if (traceparent == NULL)
		return headers;

	if (tracestate != NULL && headers != NULL &&
		getKeyJsonValueFromContainer(&headers->root, TRACESTATE,
									 strlen(TRACESTATE), &v) != NULL)
		tracestate = NULL;
	return add_headers(headers, traceparent, tracestate);
}

/*
 * Set comment_traceparent/tracestate from the last sqlcommenter comment
 * with a valid traceparent in the text of the statement being run
 * (debug_query_string: for a function or trigger, the client's statement
 * that called it), unless they were found for this statement already.
 */
static void
find_comment_context(void)
{
	const char *p = debug_query_string;
	const char *body;
	const char *body_end;
	MemoryContext oldcxt;

	if (p == comment_query && GetCurrentStatementStartTimestamp() == comment_statement_start)
		return;
	if (comment_traceparent != NULL)
		pfree(comment_traceparent);
	if (comment_tracestate != NULL)
		pfree(comment_tracestate);
	comment_traceparent = comment_tracestate = NULL;
	comment_query = p;
	comment_statement_start = GetCurrentStatementStartTimestamp();

	oldcxt = MemoryContextSwitchTo(TopMemoryContext);
	while (p != NULL && (p = next_comment(p, &body, &body_end)) != NULL)
	{
		char	   *traceparent = NULL;
		char	   *tracestate = NULL;

		parse_comment(body, body_end, &traceparent, &tracestate);
		if (traceparent != NULL && outbox_traceparent_is_valid(traceparent))
		{
			if (comment_traceparent != NULL)
				pfree(comment_traceparent);
			if (comment_tracestate != NULL)
				pfree(comment_tracestate);
			comment_traceparent = traceparent;
			comment_tracestate = NULL;
			if (tracestate != NULL && outbox_tracestate_is_valid(tracestate))
				comment_tracestate = tracestate;
			else if (tracestate != NULL)
				pfree(tracestate);
		}
		else
		{
			if (traceparent != NULL)
				pfree(traceparent);
			if (tracestate != NULL)
				pfree(tracestate);
		}
	}
	MemoryContextSwitchTo(oldcxt);
}

/*
 * The next comment /\* ... *\/ of SQL text p, outside string literals, quoted
 * identifiers, dollar quotes and -- comments (text in a literal that looks
 * like a comment is data, not the application's comment): its body between
 * *body and *body_end, and the text after it as the result; NULL if there is
 * none.  Comments nest, as PostgreSQL's do.  Literals follow the server's
 * rules: backslash escapes in E'...', and in '...' too while
 * standard_conforming_strings is off.
 */
static const char *
next_comment(const char *p, const char **body, const char **body_end)
{
	char		prev = ' ';

	while (*p != '\0')
	{
		if (p[0] == '/' && p[1] == '*')
		{
			int			depth = 1;
			const char *q = p + 2;

			while (*q != '\0' && depth > 0)
			{
				if (q[0] == '/' && q[1] == '*')
					depth++, q += 2;
				else if (q[0] == '*' && q[1] == '/')
					depth--, q += 2;
				else
					q++;
			}
			if (depth > 0)
				return NULL;	/* unterminated: not a comment the server ran */
			*body = p + 2;
			*body_end = q - 2;
			return q;
		}
		if (p[0] == '-' && p[1] == '-')
			p = skip_to(p, "\n");
		else if (*p == '\'')
			p = skip_literal(p + 1, '\'',
							 prev == 'E' || prev == 'e' || !standard_conforming_strings);
		else if (*p == '"')
			p = skip_literal(p + 1, '"', false);
		else if (*p == '$' && !IS_IDENT_CHAR(prev) && !isdigit((unsigned char) p[1]))
			p = skip_dollar_quote(p);
		else
			p++;
		prev = p[-1];
	}
	return NULL;
}

/* past the next occurrence of s in p, or the end of p */
static const char *
skip_to(const char *p, const char *s)
{
	const char *found = strstr(p, s);

	return found != NULL ? found + strlen(s) : p + strlen(p);
}

/* past the closing quote of a literal opened just before p ('' inside) */
static const char *
skip_literal(const char *p, char quote, bool backslash)
{
	while (*p != '\0')
	{
		if (backslash && *p == '\\' && p[1] != '\0')
			p += 2;
		else if (*p == quote && p[1] == quote)
			p += 2;
		else if (*p == quote)
			return p + 1;
		else
			p++;
	}
	return p;
}

/*
 * p is at a '$' that may open a dollar quote $tag$...$tag$: past its end if
 * it does, else just past the '$'.
 */
static const char *
skip_dollar_quote(const char *p)
{
	const char *tag_end = p + 1;
	char	   *tag;
	const char *end;

	while (IS_IDENT_CHAR(*tag_end))
		tag_end++;
	if (*tag_end != '$')
		return p + 1;
	tag = pnstrdup(p, tag_end - p + 1);
	end = strstr(tag_end + 1, tag);
	end = end != NULL ? end + strlen(tag) : tag_end + 1 + strlen(tag_end + 1);
	pfree(tag);
	return end;
}

/*
 * Read sqlcommenter's key='value',key='value' between start and end; the
 * values of traceparent and tracestate (URL-decoded) go to the out
 * arguments.  Anything that is not of that shape ends the reading.
 */
static void
parse_comment(const char *start, const char *end, char **traceparent,
			  char **tracestate)
{
	const char *p = start;

	while (p < end)
	{
		const char *key;
		const char *key_end;
		const char *value;

		while (p < end && (*p == ' ' || *p == ',' || *p == '\n' || *p == '\t'))
			p++;
		key = p;
		while (p < end && *p != '=' && *p != ' ')
			p++;
		key_end = p;
		if (p + 1 >= end || *p != '=' || p[1] != '\'')
			return;
		value = p += 2;
		while (p < end && *p != '\'')
			p += (*p == '\\' && p + 1 < end) ? 2 : 1;
		if (p >= end)
			return;
		if (key_end - key == strlen(TRACEPARENT) &&
			strncmp(key, TRACEPARENT, key_end - key) == 0)
			replace_value(traceparent, decode_value(value, p));
		else if (key_end - key == strlen(TRACESTATE) &&
				 strncmp(key, TRACESTATE, key_end - key) == 0)
			replace_value(tracestate, decode_value(value, p));
		p++;
	}
}

/* *target = value, freeing what it held (a key given twice: the last wins) */
static void
replace_value(char **target, char *value)
{
	if (*target != NULL)
		pfree(*target);
	*target = value;
}

/*
 * A sqlcommenter value: \' is a quote, %XX a URL-encoded byte.  Returns a
 * palloc'd string, or NULL for a value with a %00; a bad %-sequence is kept
 * as it is (and the value then fails validation).
 */
static char *
decode_value(const char *start, const char *end)
{
	char	   *result = palloc(end - start + 1);
	char	   *out = result;
	const char *p;

	for (p = start; p < end; p++)
	{
		if (*p == '\\' && p + 1 < end)
			*out++ = *++p;
		else if (*p == '%' && p + 2 < end && isxdigit((unsigned char) p[1]) &&
				 isxdigit((unsigned char) p[2]))
		{
			char		hex[3] = {p[1], p[2], '\0'};

			*out = (char) strtol(hex, NULL, 16);
			if (*out++ == '\0')
			{
				/* %00: no valid value has one; never cut the value short */
				pfree(result);
				return NULL;
			}
			p += 2;
		}
		else
			*out++ = *p;
	}
	*out = '\0';
	return result;
}

/* are the n bytes at s lower-case hex digits (all '0' in *all_zero)? */
static bool
is_lower_hex(const char *s, int n, bool *all_zero)
{
	int			i;

	*all_zero = true;
	for (i = 0; i < n; i++)
	{
		if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
			return false;
		if (s[i] != '0')
			*all_zero = false;
	}
	return true;
}

/* headers || {"traceparent": ..., "tracestate": ...} */
static Jsonb *
add_headers(Jsonb *headers, const char *traceparent, const char *tracestate)
{
	JsonbParseState *state = NULL;
	JsonbValue	k;
	JsonbValue	v;
	JsonbValue *object;
	Jsonb	   *added;

	k.type = v.type = jbvString;
	(void) pushJsonbValue(&state, WJB_BEGIN_OBJECT, NULL);
	k.val.string.val = TRACEPARENT;
	k.val.string.len = strlen(TRACEPARENT);
	v.val.string.val = (char *) traceparent;
	v.val.string.len = strlen(traceparent);
	(void) pushJsonbValue(&state, WJB_KEY, &k);
	(void) pushJsonbValue(&state, WJB_VALUE, &v);
	if (tracestate != NULL)
	{
		k.val.string.val = TRACESTATE;
		k.val.string.len = strlen(TRACESTATE);
		v.val.string.val = (char *) tracestate;
		v.val.string.len = strlen(tracestate);
		(void) pushJsonbValue(&state, WJB_KEY, &k);
		(void) pushJsonbValue(&state, WJB_VALUE, &v);
	}
	object = pushJsonbValue(&state, WJB_END_OBJECT, NULL);
	added = JsonbValueToJsonb(object);
	if (headers == NULL)
		return added;
	return DatumGetJsonbP(DirectFunctionCall2(jsonb_concat,
											  JsonbPGetDatum(headers),
											  JsonbPGetDatum(added)));
}
