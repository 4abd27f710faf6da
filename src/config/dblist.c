/*-------------------------------------------------------------------------
 *
 * dblist.c
 *	  Which databases get a relay: outbox.databases, and pg_database as a
 *	  process without a database connection can read it.
 *
 * outbox.databases is '' (the 1.x setting outbox.database names the one
 * database), a comma-separated list of names, or '*': every database that
 * accepts connections, is not a template and has the extension.  Whether a
 * database has the extension can only be seen from inside it, so for '*'
 * the launcher asks a relay to find out (launcher.c).
 *
 *-------------------------------------------------------------------------
 */
#include "outbox.h"
#include "config/dblist.h"
#include "config/guc.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "catalog/pg_database.h"
#include "commands/dbcommands.h"
#include "miscadmin.h"
#include "utils/guc.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/varlena.h"

static bool replace_value(char **newval, const char *value);

/*
 * outbox_check_databases
 *		The check hook of outbox.databases: '', '*' or a comma-separated
 *		list of database names (SplitGUCList: double quotes keep commas and
 *		spaces, nothing is downcased), no empty item, '*' only alone, no
 *		name of NAMEDATALEN bytes or more.  source is a GucSource.  A value
 *		of blanks is stored as '', and ' * ' as '*', the values everything
 *		else compares with.
 */
bool
outbox_check_databases(char **newval, void **extra, GucSource source)
{
	List	   *items;
	ListCell   *lc;

	if (strcmp(*newval, "*") == 0)
		return true;
	if (!SplitGUCList(pstrdup(*newval), ',', &items))
	{
		GUC_check_errdetail("outbox.databases must be *, or a comma-separated list of database names without empty items.");
		return false;
	}
	if (items == NIL ||
		(list_length(items) == 1 && strcmp(linitial(items), "*") == 0))
		return replace_value(newval, items == NIL ? "" : "*");
	foreach(lc, items)
	{
		const char *name = lfirst(lc);

		if (name[0] == '\0')
		{
			GUC_check_errdetail("outbox.databases has an empty item.");
			return false;
		}
		if (strcmp(name, "*") == 0)
		{
			GUC_check_errdetail("\"*\" must be the only item of outbox.databases.");
			return false;
		}
		if (strlen(name) >= NAMEDATALEN)
		{
			GUC_check_errdetail("Database name \"%s\" is longer than %d bytes.",
								name, NAMEDATALEN - 1);
			return false;
		}
	}
	return true;
}

/*
 * Replace a check hook's *newval by value, allocated as GUC values are.
 * False (the value is refused) only when out of memory.
 */
static bool
replace_value(char **newval, const char *value)
{
	char	   *copy = outbox_guc_strdup(value);

	if (copy == NULL)
		return false;
	outbox_guc_free(*newval);
	*newval = copy;
	return true;
}

/*
 * outbox_check_database
 *		The check hook of outbox.database (1.x): one database name, not
 *		empty (no database has that name: the relay would wait for it for
 *		ever) and shorter than NAMEDATALEN bytes.  source is a GucSource.
 */
bool
outbox_check_database(char **newval, void **extra, GucSource source)
{
	if ((*newval)[0] == '\0')
	{
		GUC_check_errdetail("outbox.database must name a database.");
		GUC_check_errhint("Set outbox.database to the database whose outbox is relayed, or list several in outbox.databases.");
		return false;
	}
	if (strlen(*newval) >= NAMEDATALEN)
	{
		GUC_check_errdetail("Database name \"%s\" is longer than %d bytes.",
							*newval, NAMEDATALEN - 1);
		return false;
	}
	return true;
}

/*
 * outbox_relayed_databases
 *		The names of the databases that should have a relay: those of
 *		outbox.databases, or outbox.database when that is empty, as a List
 *		of palloc'd strings in the order written (the order in which they
 *		get slots).  For '*', *all is set and NIL returned.
 */
List *
outbox_relayed_databases(bool *all)
{
	List	   *items = NIL;

	*all = false;
	if (outbox_databases == NULL || outbox_databases[0] == '\0')
		return list_make1(pstrdup(outbox_database));
	if (strcmp(outbox_databases, "*") == 0)
	{
		*all = true;
		return NIL;
	}
	/* the check hook accepted it, so it splits */
	(void) SplitGUCList(pstrdup(outbox_databases), ',', &items);
	return items;
}

/*
 * outbox_database_relayed
 *		Is database name covered by outbox.databases (or outbox.database)?
 *		'*' covers every database: a database in which this is asked has
 *		the extension.
 */
bool
outbox_database_relayed(const char *name)
{
	bool		all;
	List	   *names = outbox_relayed_databases(&all);
	ListCell   *lc;

	if (all)
		return true;
	foreach(lc, names)
	{
		if (strcmp((char *) lfirst(lc), name) == 0)
			return true;
	}
	return false;
}

/*
 * outbox_scan_databases
 *		Every row of pg_database (oid, name, datallowconn, datistemplate) as
 *		a palloc'd array; *count is set to its length.  A heap scan, as
 *		autovacuum's get_database_list() does: a process without a database
 *		connection cannot use the catalog caches.  Call in a transaction.
 */
OutboxDatabase *
outbox_scan_databases(int *count)
{
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tuple;
	int			size = 16;
	OutboxDatabase *dbs = palloc(sizeof(OutboxDatabase) * size);

	*count = 0;
	rel = table_open(DatabaseRelationId, AccessShareLock);
	scan = table_beginscan_catalog(rel, 0, NULL);
	while (HeapTupleIsValid(tuple = heap_getnext(scan, ForwardScanDirection)))
	{
		Form_pg_database row = (Form_pg_database) GETSTRUCT(tuple);

		if (*count == size)
		{
			size *= 2;
			dbs = repalloc(dbs, sizeof(OutboxDatabase) * size);
		}
		dbs[*count].oid = row->oid;
		strlcpy(dbs[*count].name, NameStr(row->datname), NAMEDATALEN);
		dbs[*count].allow_connections = row->datallowconn;
#ifdef DATCONNLIMIT_INVALID_DB
		/* left behind by an interrupted DROP DATABASE: cannot be entered */
		if (row->datconnlimit == DATCONNLIMIT_INVALID_DB)
			dbs[*count].allow_connections = false;
#endif
		dbs[*count].is_template = row->datistemplate;
		(*count)++;
	}
	table_endscan(scan);
	table_close(rel, AccessShareLock);
	return dbs;
}
